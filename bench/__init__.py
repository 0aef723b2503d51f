"""Tasklet bench package."""
