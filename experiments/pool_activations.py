"""Seed 001 analysis: print the shape of the pooling layer's activation (torch.Size([1, 8, 4, 4]))."""
from hookrun.experiments._cli import open_run


def main(argv=None):
    cap = open_run(argv)
    for row in cap.rows(hook="feats").itertuples():
        print(f"{row.layer}.{row.role} shape: {row.shape}  mean {row.mean:.4f}  std {row.std:.4f}")
    feat = cap.load(hook="feats", layer=cap.rows(hook="feats").layer.iloc[0], role="output")
    print("feats['feat'].shape ->", list(feat.shape))


if __name__ == "__main__":
    main()
