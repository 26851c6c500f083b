"""The warehouse's read-only inventory API."""
