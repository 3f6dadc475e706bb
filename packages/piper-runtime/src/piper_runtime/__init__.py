"""piper-runtime."""
