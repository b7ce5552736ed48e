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
    p.add_argument("--resume", nargs="?", const="", default=None, metavar="PATH",
                   help="continue from the latest checkpoint of the newest run of the recipe's "
                        "run.name, or of PATH (a run directory or one checkpoints/step_N)")
    p.add_argument("--allow-config-change", action="store_true",
                   help="with --resume: accept config changes beyond steps, checkpointing and "
                        "logging (the resumed run is then not the run it continues)")
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
        point = None
        if args.resume is not None:
            from rl.run.checkpoint import check_resume, find_resume_point

            point = find_resume_point(cfg, args.resume or None)
            check_resume(cfg, point, args.allow_config_change)
        from rl.preflight import preflight

        rows = preflight(cfg)
    except ConfigError as e:
        print(f"rl-train: {e}", file=sys.stderr)
        return 2
    import shlex

    import ray

    from rl.errors import death_cause, stop_on_sigterm

    stop_on_sigterm()

    from rl.errors import ActorFailure
    from rl.run.checkpoint import CheckpointError
    from rl.run.controller import Controller

    def resume_command(run_dir) -> str:
        return shlex.join(["rl-train", args.recipe, *args.overrides, "--resume", str(run_dir)])

    try:
        Controller(cfg, rows, resume=point, resume_command=resume_command).run()
    except ConfigError as e:  # found by the controller before Ray starts (prompts, tokenizer)
        print(f"rl-train: {e}", file=sys.stderr)
        return 2
    except (CheckpointError, ActorFailure) as e:
        print(f"rl-train: {e}", file=sys.stderr)
        return 1
    except ray.exceptions.RayActorError as e:  # outside a step (set-up, a restart, the save)
        print(f"rl-train: an actor died outside a step ({death_cause(e)}); resume with: "
              f"{resume_command(point.run_dir if point else '<run directory>')}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        # a deliberate stop, not a failure: the controller has stopped its actors and closed
        # its logs; what was written stays
        print("rl-train: stopped by a signal; the run directory keeps every step logged so far",
              file=sys.stderr)
        return 130
    return 0


def eval_main(argv: list[str] | None = None) -> int:
    """`rl-eval RECIPE MODEL_DIR [key=value ...]`: score a saved model on the recipe's held-out
    prompts exactly as a run's evaluation does (the same split, engines and seeds)."""
    p = argparse.ArgumentParser(
        prog="rl-eval", description="Held-out evaluation of a saved model, as rl-train does it.",
        epilog="example: rl-eval recipes/quickstart.yaml runs/quickstart/final_model")
    p.add_argument("recipe", help="the recipe (or a run's config.yaml) that defines the held-out "
                                  "set, the reward and the engines")
    p.add_argument("model", help="a Hugging Face model directory (e.g. a run's final_model)")
    p.add_argument("overrides", nargs="*", help="key=value overrides, as for rl-train")
    p.add_argument("--output", default=None, metavar="DIR",
                   help="write eval.json and the responses (step_0.jsonl) here")
    args = p.parse_args(argv)
    from pathlib import Path

    from rl.config import ConfigError, load_config

    try:
        cfg = load_config(args.recipe, args.overrides)
        if (Path(args.model) / "adapter_config.json").exists():
            raise ConfigError(f"model '{args.model}' is a LoRA adapter; give the merged model "
                              f"saved beside it ({Path(args.model).name}_merged)")
        cfg.trainer.lora = None  # a saved model is whole: the engines load no adapter
        if not (Path(args.model) / "config.json").exists():
            raise ConfigError(f"model '{args.model}' is not a Hugging Face model directory (no "
                              f"config.json); give a run's final_model or a saved checkpoint")
        if not (cfg.data.eval_path or cfg.data.eval_fraction):
            raise ConfigError(f"recipe '{args.recipe}' has no held-out set; set "
                              f"data.eval_fraction (e.g. 0.1) or data.eval_path")
        from rl.preflight import preflight

        rows = preflight(cfg)
        from rl.run.evaluate import evaluate_model

        metrics = evaluate_model(cfg, rows, args.model,
                                 Path(args.output) if args.output else None)
    except ConfigError as e:
        print(f"rl-eval: {e}", file=sys.stderr)
        return 2
    import json

    print(json.dumps(metrics, indent=1, sort_keys=True))
    return 0


def plan_main(argv: list[str] | None = None) -> int:
    """`rl-plan RECIPE [key=value ...] [--hardware H] [--gpus-per-node G] [--nodes M] [--json]`:
    each device's memory and a step's time, from the model's config.json alone."""
    from rl.plan.hardware import HARDWARE_NAMES

    p = argparse.ArgumentParser(
        prog="rl-plan", description="Will a recipe fit, and how fast: memory per device and a "
                                    "step's time, from the model's config.json (no weights).",
        epilog="example: rl-plan recipes/quickstart.yaml model.path=my-7b/ --hardware h100-80g "
               "--gpus-per-node 8")
    p.add_argument("recipe", help="a YAML recipe (see recipes/)")
    p.add_argument("overrides", nargs="*", help="key=value overrides, as for rl-train")
    p.add_argument("--hardware", default="cpu", metavar="H",
                   help=f"one of {', '.join(HARDWARE_NAMES)} (cpu: this machine, measured) or a "
                        f"YAML file of rl.plan.hardware.Hardware's fields")
    p.add_argument("--gpus-per-node", type=int, default=None, metavar="G")
    p.add_argument("--nodes", type=int, default=1, metavar="M")
    p.add_argument("--prompt-tokens", type=int, default=None, metavar="P",
                   help="a prompt's tokens (default: the data's longest prompt, estimated from "
                        "its characters)")
    p.add_argument("--acceptance", type=float, default=None, metavar="A",
                   help="speculative decoding's acceptance rate (rollout/spec_accept_rate of a "
                        "run): what it gains on this hardware")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    args = p.parse_args(argv)
    from rl.config import ConfigError, load_config

    try:
        from rl.plan.run import estimated_prompt_tokens, plan_for

        overrides = list(args.overrides)
        cfg = load_config(args.recipe, overrides)
        prompt_tokens = args.prompt_tokens
        if prompt_tokens is None:
            from rl.run.rewarding import load_rows

            prompt_tokens = estimated_prompt_tokens(cfg, load_rows(cfg)[0])
        plan, fix = plan_for(cfg, overrides, args.hardware, args.gpus_per_node, args.nodes,
                             prompt_tokens, args.acceptance)
    except (ConfigError, ValueError, FileNotFoundError) as e:
        print(f"rl-plan: {e}", file=sys.stderr)
        return 2
    if args.json:
        import json

        print(json.dumps(dict(plan.to_dict(), fix=fix and {k: str(v) for k, v in fix.items()}),
                         indent=1, default=str))
    else:
        from rl.plan.report import render

        print(render(plan, fix))
    return 0


if __name__ == "__main__":
    sys.exit(main())
