"""Models, losses and analysis scripts of hookrun's bundled experiments (conf/experiment/*.yaml)."""
