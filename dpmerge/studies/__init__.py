"""Studies that reproduce the experiments of SPEC §8."""
