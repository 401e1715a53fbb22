"""Pictures that hookrun.plot (hookrun/read/plot.py) draws, by kind: colour scales and per-token (text) pictures."""
