"""piper-directives."""
