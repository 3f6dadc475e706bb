"""piper-scheduler."""
