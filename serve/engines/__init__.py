"""One module per engine behind the small interface in ``base``."""
