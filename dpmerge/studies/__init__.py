"""Studies that reproduce the experiments of docs/design.md#studies."""
