"""The ``gmlx`` command line."""
