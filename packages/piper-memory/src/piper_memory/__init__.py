"""piper-memory."""
