"""`genq push REPO_ID`: one dataset's card and exports to the Hugging Face Hub, in one commit.

What goes up is what `genq export` wrote in the dataset's folder: its card (``README.md``, whose
``configs`` name the files by their paths there, so they go to the repository's root) and every
export file (JSON Lines and Parquet shards); never the raw records or anything of Redis. The
upload is ``huggingface_hub``'s: the token is the one it finds (``HF_TOKEN`` or a saved login),
never read, printed or logged here; files the Hub already holds (same SHA-256) are not sent again,
so a push cut short and run again sends what is missing. ``--dry-run`` builds the same commit
operations (each file's size and SHA-256, as the client computes them) and uploads nothing: what
CI checks, since it cannot reach the Hub.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import click

from genq.outputs import card
from genq.schema import EXPORTS, shard_glob
from genq.settings import option


def plan(folder: Path) -> list[Path]:
    """The files of one dataset's folder that go up: its card first, then its exports."""
    if not (folder / card.FILE).is_file():
        raise click.ClickException(f"{folder}: no {card.FILE}: run `genq export` first (it writes the card)")
    files = [folder / card.FILE]
    for name in EXPORTS.values():
        stem = name.split(".")[0]
        if name.endswith(".jsonl") and (folder / name).is_file():
            files.append(folder / name)
        files += sorted(folder.glob(shard_glob(stem)))
    return files


@click.command("push")
@click.argument("repo_id")
@option(
    "--out",
    "folder",
    required=True,
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    help="The folder `genq export` wrote (its DIR, or its --out).",
)
@option("--dataset", env="GENQ_PUSH_DATASET", default=None, help="The dataset (when DIR holds several).")
@option("--private", is_flag=True, help="Create the repository private (when it does not exist yet).")
@option("--dry-run", is_flag=True, help="Build the commit and print its files; upload nothing.")
def push_command(repo_id: str, folder: Path, dataset: str | None, private: bool, dry_run: bool) -> None:
    """Upload one dataset's card and exports to the dataset repository REPO_ID, in one commit."""
    if importlib.util.find_spec("huggingface_hub") is None:
        raise click.ClickException("genq push needs huggingface_hub: pip install 'genq[hub]'")
    from huggingface_hub import CommitOperationAdd, HfApi
    from huggingface_hub.errors import HfHubHTTPError

    names = sorted(p.parent.name for p in folder.glob(f"*/{card.FILE}"))
    if not names and dataset is None:
        raise click.ClickException(
            f"{folder}: no dataset there has a card and exports to push: run `genq export {folder}` first"
        )
    if dataset is None and len(names) != 1:
        raise click.UsageError(
            f"--dataset NAME: one dataset a repository (carded in {folder}: {', '.join(names)})"
        )
    files = plan(folder / (dataset or names[0]))
    operations = [CommitOperationAdd(path_in_repo=f.name, path_or_fileobj=str(f)) for f in files]
    for op in operations:
        info = op.upload_info
        click.echo(f"{op.path_in_repo}: {info.size:,} bytes, sha256 {info.sha256.hex()[:16]}")
    if dry_run:
        click.echo(f"dry run: {len(operations)} files for {repo_id}, nothing uploaded")
        return
    api = HfApi()
    try:
        api.create_repo(repo_id, repo_type="dataset", private=private, exist_ok=True)
        commit = api.create_commit(
            repo_id,
            operations=operations,
            repo_type="dataset",
            commit_message=f"genq {dataset or names[0]}: {len(operations)} files",
        )
    except (HfHubHTTPError, OSError, ValueError) as exc:  # ValueError: the Hub found the card's YAML invalid
        why = " ".join(str(exc).split())  # the client's messages run over several lines
        raise click.ClickException(f"the Hub refused the push of {repo_id}: {why}") from exc
    click.echo(f"pushed {len(operations)} files to {commit.commit_url}")
