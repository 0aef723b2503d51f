"""Tasklet peer package."""
