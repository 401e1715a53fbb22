"""lens analysis: the logit lens table of a happy and a sad prompt (the top token at each layer and position),
the log-probability of " good" and " bad" at the last position layer by layer, the DLA of logit(answer) -
logit(wrong) (the prompt's mood word against the other mood's) per block and head, and the pictures
RUN_DIR/plots/lens.png, dla.png and dla_heads.png."""
from pathlib import Path

import numpy as np

from hookrun.experiments._cli import open_run
from hookrun.read.plots import lens as pictures


def write_pictures(cap) -> list:
    """The lens run's pictures under RUN_DIR/plots/."""
    out = Path(cap.path).parent / "plots"
    out.mkdir(exist_ok=True)
    written = []
    for make, name in pictures.pictures(cap):
        make().savefig(out / name, dpi=110)
        written.append(out / name)
    return written


def main(argv=None):
    cap = open_run(argv)
    lens = cap.read("lens")
    n = len(lens.samples)
    for row in (0, n - 1):
        print(f"\nlogit lens of sample {lens.samples[row]} (top token and its probability; columns: positions):")
        print(lens.sample_table(row).to_string())
    frame = lens.to_frame()
    last = frame[frame.groupby("sample")["position"].transform("max") == frame["position"]]
    print("\nat the last position, mean over the prompts of each mood:")
    moods = cap.samples.set_index("sample")["mood"]
    happy = last["sample"].map(moods) == "happy"
    cols = [c for c in frame.columns if c.startswith("logprob[")]
    table = last.groupby([happy.map({True: "happy", False: "sad"}), "layer"], sort=False)[cols + ["prob"]].mean()
    print(table.round(3).to_string())
    dla = lens.dla
    print(f"\n{dla!r}")
    parts = dla.frame()
    print(f"\nDLA of {dla.answer} per prompt (each row's parts sum to the model's logit difference):")
    print(parts.round(3).to_string())
    print("\nmean per block, each mood's prompts:")
    mood = cap.samples["mood"].to_numpy()
    for name in ("happy", "sad"):
        mean = dla.parts[mood == name].mean(0)
        print(f"  {name}: " + ", ".join(f"{c.split('transformer.')[-1]} {v:+.2f}" for c, v in zip(dla.components, mean)))
    print(f"\neach head's mean share, layers x heads:\n{np.round(dla.heads.mean(0), 2)}")
    print("\ntop parts (mean over all prompts):")
    print(dla.top(6).to_string(index=False))
    for path in write_pictures(cap):
        print(path)


if __name__ == "__main__":
    main()
