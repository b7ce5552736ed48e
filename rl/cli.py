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
    """Load the recipe, check the data against the rewards, train; a refusal at start is one
    line `rl-train: ...` on stderr and exit status 2."""
    args = parse_args(argv)
    from rl.config import ConfigError, load_config, to_yaml

    try:
        cfg = load_config(args.recipe, args.overrides)
        if args.print_config:
            print(to_yaml(cfg))
            return 0
        from rl.rewarding import checked_rows

        rows = checked_rows(cfg)
    except (ConfigError, FileNotFoundError) as e:
        print(f"rl-train: {e}", file=sys.stderr)
        return 2
    import signal

    def stop(signum, frame):  # `ray job stop` and `kill` send SIGTERM: stop like Ctrl-C
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    from rl.controller import Controller

    try:
        Controller(cfg, rows).run()
    except KeyboardInterrupt:
        # a deliberate stop, not a failure: the controller has stopped its actors and closed
        # its logs; what was written stays
        print("rl-train: stopped by a signal; the run directory keeps every step logged so far",
              file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
