"""One run from a composed config: checks, the Run built from it, the first-batch check, ranks, the loop, the summary.

    from hookrun.engine.runner import run
    run(cfg)
"""
