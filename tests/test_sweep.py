"""Hydra multiruns over layers (basic, joblib and submitit_local launchers), collected into one DataFrame;
the SLURM example config composes; local parallel jobs share the cores."""
import numpy as np
import pytest

import hookrun
from tests.helpers import run_cli


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["basic", "joblib", "submitit_local"])
def test_layer_sweep_collects_into_one_dataframe(tmp_path, launcher):
    run_cli("-m", "+experiment=conv_fmaps", "layers=conv1,pool1", "seed=3", f"hydra/launcher={launcher}",
            f"hydra.sweep.dir={tmp_path}")
    jobs = sorted(p.name for p in tmp_path.iterdir() if p.is_dir() and not p.name.startswith("."))  # .submitit: its logs
    assert jobs == ["0", "1"]  # one store per job
    df = hookrun.collect(tmp_path)
    fmaps = df[(df.hook == "fmaps") & (df.role == "output")]
    assert sorted(zip(fmaps.layers, fmaps.layer)) == [("conv1", "conv1"), ("pool1", "pool1")]
    assert set(df.status) == {"complete"} and set(df.experiment) == {"conv_fmaps"}
    assert set(df.seed) == {3} and df.seed.dtype.kind == "i"  # parsed as Hydra does, not '3'
    by_layer = fmaps.set_index("layer")
    assert by_layer.loc["conv1", "shape"] == "[1, 2, 2, 2]" and by_layer.loc["pool1", "shape"] == "[1, 2, 1, 1]"
    assert by_layer.loc["pool1", "max"] == 18.0
    pool = hookrun.open(tmp_path / fmaps.set_index("layer").loc["pool1", "job"])
    assert pool.load(layer="pool1", role="output").ravel().tolist() == [9.0, 18.0]
    np.testing.assert_array_equal(pool.load(layer="pool1", role="input.0")[0, 1], np.full((2, 2), 18.0))

    threads = {hookrun.open(tmp_path / job).attrs["threads"] for job in ("0", "1")}
    if launcher == "basic":  # one job at a time: torch keeps its default
        assert threads == {__import__("torch").get_num_threads()}
    else:  # joblib (n_jobs=-1: a job per core) and submitit_local (all at once): the cores are split
        assert threads == {1}


def test_slurm_example_config_composes():
    from hydra import compose, initialize_config_dir

    from tests.helpers import REPO

    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=["+experiment=conv_fmaps", "hydra/launcher=slurm",
                                                       "hydra.launcher.partition=gpu"], return_hydra_config=True)
    launcher = cfg.hydra.launcher
    assert launcher._target_ == "hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher"
    assert (launcher.partition, launcher.gpus_per_node, launcher.cpus_per_task, launcher.mem_gb,
            launcher.timeout_min) == ("gpu", 1, 8, 32, 120)


def test_parallel_jobs_split_the_cores():
    from omegaconf import OmegaConf

    from hookrun.engine.cores import parallel_jobs

    def launcher(**kw):
        return OmegaConf.create(kw)
    joblib = "hydra_plugins.hydra_joblib_launcher.joblib_launcher.JoblibLauncher"
    local = "hydra_plugins.hydra_submitit_launcher.submitit_launcher.LocalLauncher"
    assert parallel_jobs(launcher(_target_=joblib, n_jobs=-1), 16) == 16
    assert parallel_jobs(launcher(_target_=joblib, n_jobs=-2), 16) == 15
    assert parallel_jobs(launcher(_target_=joblib, n_jobs=4), 16) == 4
    assert parallel_jobs(launcher(_target_=local), 16) == 16
    assert parallel_jobs(launcher(_target_="hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher"),
                         16) == 1


def test_one_thread_puts_torchs_threads_back():
    """hookrun.threads.one_thread (the first batch's small checks, the training's small steps): one torch thread
    inside, the count before it after, an exception inside included; a forward pass in it gives the same values as
    on every thread; one_thread(False) leaves the count as it is."""
    import torch

    from hookrun.threads import one_thread

    before = torch.get_num_threads()
    model, x = torch.nn.Conv2d(3, 8, 3), torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        expected = model(x)
        with one_thread():
            assert torch.get_num_threads() == 1
            got = model(x)
    assert torch.get_num_threads() == before
    torch.testing.assert_close(got, expected)
    with pytest.raises(RuntimeError, match="inside"):
        with one_thread():
            raise RuntimeError("inside")
    assert torch.get_num_threads() == before
    with one_thread(False):
        assert torch.get_num_threads() == before
