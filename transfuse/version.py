"""The version of transfuse, in a module of its own so that any layer can name it."""

__version__ = "0.1.0"
