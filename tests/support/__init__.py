"""Shared fixtures, fakes and waits of the test suite (imported by tests, never by production code)."""
