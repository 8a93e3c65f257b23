"""The inference engine: no HTTP, no CLI."""
