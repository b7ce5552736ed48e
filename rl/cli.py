"""`rl-train RECIPE.yaml [key=value ...]`: run a recipe. Heavy imports happen after parsing."""
from __future__ import annotations

import argparse
import sys


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="rl-train",
        description="RL post-training of an LLM: vLLM rollout, DeepSpeed ZeRO-3 update, on Ray.",
        epilog="example: rl-train recipes/quickstart.yaml trainer.total_steps=20 rollout.n=8")
    p.add_argument("recipe", help="a YAML recipe (see recipes/)")
    p.add_argument("overrides", nargs="*", help="key=value overrides, e.g. rollout.n=8")
    p.add_argument("--print-config", action="store_true",
                   help="print the resolved config and exit without training")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from rl.config import ConfigError, load_config, to_yaml

    try:
        cfg = load_config(args.recipe, args.overrides)
    except (ConfigError, FileNotFoundError) as e:
        print(f"rl-train: {e}", file=sys.stderr)
        return 2
    if args.print_config:
        print(to_yaml(cfg))
        return 0
    from rl.controller import Controller

    Controller(cfg).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
