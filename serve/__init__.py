"""The middle floor: engines, adapter pool, gateway and engine policy. Imports ``convert`` only."""
