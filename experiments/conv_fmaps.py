"""Seed 003 analysis: print the model output, conv1's feature maps and its input, as the article does."""
from hookrun.experiments._cli import open_run


def main(argv=None):
    cap = open_run(argv)
    out = cap.load(layer="_model", role="output")
    print(f"output shape: {list(out.shape)}\noutput value: {out.ravel().tolist()}\n")
    for layer in sorted(set(cap.rows(hook="fmaps").layer)):
        fmap = cap.load(hook="fmaps", layer=layer, role="output")
        print(f"feature maps of {layer} shape: {list(fmap.shape)}\noutput value:\n{fmap}\n")
        if len(cap.rows(hook="fmaps", layer=layer, role="input.0")):
            inp = cap.load(hook="fmaps", layer=layer, role="input.0")
            print(f"input shape: {list(inp.shape)}\ninput value:\n{inp}")
    stats = cap.index[["hook", "layer", "role", "shape", "mean", "min", "max"]]
    print("\nfrom the index alone:\n" + stats.to_string(index=False))


if __name__ == "__main__":
    main()
