"""The on-disk format both the writer and the read side use: where a key lives, and how a store is checked.

    from hookrun.format.location import Location
"""
