"""dpmerge: differentially private model merging (see SPEC.md and README.md)."""

__version__ = "0.1.0"
