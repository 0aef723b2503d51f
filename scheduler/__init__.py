"""Tasklet scheduler package."""
