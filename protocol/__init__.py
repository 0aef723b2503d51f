"""Tasklet protocol package."""
