"""The `genq` command line: gathers each role's commands under one name."""

from __future__ import annotations

import importlib

import click
import redis

from genq.connection import RedisURLError
from genq.redis_errors import NOT_NOW, fatal, not_now
from genq.version import __version__

# Each command, imported only when it runs (click's lazily loaded subcommands): a worker starts
# without loading the collector, the dataset readers, the simulator or the views (rich).
ROLES = {
    "status": "genq.commands.views.status_command",
    "monitor": "genq.commands.views.monitor_command",
    "failed": "genq.commands.failed.failed_command",
    "retry": "genq.commands.failed.retry_command",
    "enqueue": "genq.producer.cli.enqueue_command",
    "worker": "genq.worker.cli.worker_command",
    "collect": "genq.collector.cli.collect_command",
    "check": "genq.commands.check.check_command",
    "export": "genq.outputs.export.export_command",
    "stats": "genq.outputs.stats.stats_command",
    "report": "genq.outputs.report.report_command",
    "dashboard": "genq.commands.dashboard.dashboard_command",
    "run": "genq.commands.run.run_command",
    "verify": "genq.commands.verify.verify_command",
    "sim-server": "genq.sim.cli.sim_server",
    "sim-tokenizer": "genq.sim.tokenizers.sim_tokenizer",
    "slurm": "genq.commands.slurm.slurm_command",
    "push": "genq.commands.push.push_command",
}


class LazyGroup(click.Group):
    def invoke(self, ctx: click.Context) -> object:
        """Every command's operational errors in one line with what to do, not a traceback: a
        Redis that cannot be reached or refuses (genq/redis_errors.py), a Redis URL it cannot
        dial. A Redis error that is a bug is one line too (``fatal``)."""
        try:
            return super().invoke(ctx)
        except RedisURLError as exc:
            raise click.ClickException(str(exc)) from exc
        except redis.RedisError as exc:
            reason = not_now(exc)
            if reason is None:
                raise click.ClickException(fatal(exc)) from exc
            if reason.startswith(NOT_NOW["WRONGTYPE"]):
                raise click.ClickException(f"{reason}; the roles wait for it to be put right") from exc
            raise click.ClickException(
                f"{reason.rstrip('.')}; is redis-server running where --redis (GENQ_REDIS_URL) points? "
                "`genq run` starts a private one"
            ) from exc

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted([*super().list_commands(ctx), *ROLES])

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name in ROLES:
            module, attr = ROLES[name].rsplit(".", 1)
            return getattr(importlib.import_module(module), attr)
        return super().get_command(ctx, name)


@click.group(
    cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100}
)
@click.version_option(__version__, prog_name="genq")
def main() -> None:
    """genq: datasets of prompts in, synthetic training data out, nothing lost or duplicated."""
