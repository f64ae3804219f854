"""The Hivenet router daemon."""
