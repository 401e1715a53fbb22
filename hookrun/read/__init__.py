"""The read side: open a store, load captures, the index and tables, sweeps, pictures.

    from hookrun.read.captures import open, collect
"""
