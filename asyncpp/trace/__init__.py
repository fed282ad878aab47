"""The user-facing trace API."""
