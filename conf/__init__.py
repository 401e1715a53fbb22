"""hookrun's bundled Hydra configs (the package hookrun.conf: conf/ in a clone, inside the wheel): config.yaml and
the groups model/, data/, loss/, store/, hydra/launcher/ and experiment/.

    python -m hookrun +experiment=conv_fmaps           # Hydra finds them as the config module hookrun.conf
"""
