"""piper-train."""
