"""The package version (one place; imported by the package and by manifests)."""

__version__ = "0.1.0"
