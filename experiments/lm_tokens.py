"""lm_tokens analysis: the top-activating tokens of one unit of the last block, with their context."""
from hookrun.experiments._cli import open_run


def main(argv=None, unit: int = 0, k: int = 10):
    cap = open_run(argv)
    tokens = cap.tokens()
    print(f"{len(tokens)} stored tokens in {tokens['sample'].nunique()} sequences; first tokens:")
    print(tokens.head(8).to_string(index=False))
    per_token = cap.index[cap.index["unit"] == "token"]
    layer = sorted(per_token.layer.unique())[-1]
    role = sorted(per_token[per_token.layer == layer].role.unique())[0]
    print(f"\n{layer} {role}: {cap.load(layer=layer, role=role).shape} (row i = token i above)")
    print(f"top {k} tokens of unit {unit}:")
    print(cap.top(layer=layer, role=role, unit=unit, k=k, context=5).to_string(index=False))


if __name__ == "__main__":
    main()
