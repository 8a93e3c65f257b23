"""The Textual `gmlx top` dashboard (planned)."""
