"""induction_attribution analysis, as for the other induction runs: python -m hookrun.experiments.induction RUN_DIR
reads any of the three; python -m hookrun.experiments.induction --out DIR runs all three and compares them."""
from hookrun.experiments.induction import main

if __name__ == "__main__":
    main()
