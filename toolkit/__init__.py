"""The top floor: the CLI, inspect, doctor, demo, tiny fixtures and fidelity checks."""
