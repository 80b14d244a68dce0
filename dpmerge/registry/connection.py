"""The MLflow side of the registry: one private ``MlflowClient`` and the calls the registry
makes through it (search filters: :func:`~dpmerge.registry.filters.search_filter`)
and MLflow's errors turned into :class:`RegistryError` — :class:`RegistryUnavailableError`
(transient) where the error's type, code or HTTP status says the failure is temporary
(:func:`~dpmerge.registry.errors.registry_error`). Goes through this client only (no fluent
API, so no global tracking URI is read or changed).

A version holds an MLflow ``pytorch`` model in the ``pt2`` format (``torch.export``: no pickle,
loadable without dpmerge, dynamic batch dimension from a batch-4 input example) and, in its
``extra_files/``, the dpmerge model directory (``weights.safetensors``, ``model.json``,
``record.json``, ``metrics.json``; merges their public privacy card and a public merge record,
never the full privacy report, which names the candidates).
"""

from __future__ import annotations

import json
import os
import secrets
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import TYPE_CHECKING, Any

import mlflow
import numpy as np
import requests
from mlflow import MlflowClient
from mlflow.entities import LoggedModel, LoggedModelStatus
from mlflow.entities import RunInfo as MlflowRunInfo
from mlflow.entities.model_registry import ModelVersion
from mlflow.exceptions import MlflowException
from mlflow.models import Model
from mlflow.models.signature import ModelSignature
from mlflow.store.artifact.artifact_repository_registry import get_artifact_repository
from mlflow.types.schema import Schema, TensorSpec

from dpmerge.artifacts import (
    METRICS_FILE,
    MODEL_FILE,
    RECORD_FILE,
    WEIGHTS_FILE,
    ModelDir,
)
from dpmerge.environment import probe
from dpmerge.formatting import cut
from dpmerge.keys import WorkflowKey
from dpmerge.locate import command
from dpmerge.manifests import file_digests
from dpmerge.model_signature import sign_directory
from dpmerge.privacy_card import CARD_JSON, CARD_MARKDOWN, PrivacyCard
from dpmerge.publication import dataset_name
from dpmerge.registry.errors import RegistryError, RegistryUnavailableError, registry_error
from dpmerge.registry.grants import EXPERIMENT, REGISTERED_MODEL, grant_read
from dpmerge.registry.readers import configured_readers
from dpmerge.registry.tags import FAILURE_TAG, ROLE_CANDIDATE, STATUS_FAILED, tag_float
from dpmerge.registry.versions import StoredVersion

if TYPE_CHECKING:  # torch loads on first use: verifying a release traces no module
    from torch import nn

MODEL_ARTIFACT = "model"
PERMISSION_SETTLE_S = (0.5, 1.0, 2.0, 4.0)
"""Pauses between attempts to open an experiment the auth app refuses for a moment (see
``MlflowConnection._settled``): about 7.5 s in all."""
EXTRA_DIR = "extra_files"  # where mlflow.pytorch.log_model puts extra_files
INPUT_EXAMPLE_BATCH = 4  # > 1 so that pt2 export keeps the batch dimension dynamic
SERVER_ARTIFACT_ROOT = "mlflow-artifacts:"  # a server's proxied artifact store
CANDIDATES_EXPERIMENT, RELEASES_EXPERIMENT = "dpmerge-candidates", "dpmerge-releases"

UPLOAD_THREADS = 8
_ARTIFACT_URIS: dict[tuple[str, str], str] = {}
"""(tracking URI, run id) → the run's artifact location, as MLflow gave it."""
MESSAGE_LIMIT = 300
"""MLflow's messages are cut to this many characters: an error stays one readable line."""

_PT2_EXPORT_LOCK = threading.Lock()
"""Saving a pt2 model runs ``torch.export``, which is not thread-safe: two registrations from
threads (a flow registers its candidates concurrently) fail with "ProxyTorchDispatchMode slot
already occupied". Process-wide, as each thread may hold its own registry; only the save is
serialised, MLflow calls and uploads still overlap."""


def prepare_process() -> None:
    """What every registration in a process pays once, paid ahead by the warm flow-run server
    before it forks (flows/warm.py): MLflow's map of installed distributions, against which it
    checks a model's pip requirements on every save (≈ 2.5 s on the stack's hosts). Reads
    package metadata only: no thread, no connection. Only a warm-up: a failure is ignored."""
    from mlflow.utils import requirements_utils

    with suppress(Exception):  # a private MLflow helper: gone in another version, just slower
        requirements_utils._init_packages_to_modules_map()


def warm_up_export() -> None:
    """Pay the first ``torch.export`` of a process (seconds, mostly imports and first tracing)
    on a toy module, under the same lock as every save: a warm-up in one thread and a
    registration in another must not trace at once. Only a warm-up: a failure is ignored, the
    real save reports its own."""
    import torch
    from torch import nn

    with _PT2_EXPORT_LOCK, suppress(Exception):
        module = nn.Sequential(nn.Flatten(), nn.Linear(4, 2)).eval()
        torch.export.export(module, (torch.zeros((2, 1, 2, 2)),))


CLIENT_LIMITS = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_BACKOFF_JITTER": "0.5",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "15",
}
"""MLflow's client retries each HTTP request 7 times with a factor-2 backoff (≈ 4 minutes per
call) and waits 120 s for an answer: an MLflow outage then held a flow run, and the merge
deployment's only slot, for 4–12.5 minutes. These bounds (≈ 3 s of retries per call, 15 s per
read) apply unless the environment sets them; the tasks' own retries (1, 3, 10 s) come on top,
so a run fails within about a minute of an outage and frees its slot."""


def bound_client_retries() -> None:
    """Set :data:`CLIENT_LIMITS` where the environment leaves them unset (MLflow reads them at
    every request)."""
    for key, value in CLIENT_LIMITS.items():
        os.environ.setdefault(key, value)


class MlflowConnection:
    """The client for ``tracking_uri``; experiments are created on first use, each under its
    own artifact prefix below ``artifact_root`` (default: ``<db dir>/mlartifacts`` for a
    ``sqlite:///`` URI, the server's proxied store ``mlflow-artifacts:`` for a server)."""

    def __init__(self, tracking_uri: str | None, artifact_root: str | None) -> None:
        bound_client_retries()
        self.tracking_uri = tracking_uri or mlflow.get_tracking_uri()
        with self._errors("opening the registry"):  # MLflow refuses some URIs right here
            try:
                self._client = MlflowClient(self.tracking_uri, self.tracking_uri)
            except ImportError as error:  # a database URI whose driver is not installed
                raise RegistryError(
                    f"opening the registry at {self.tracking_uri}: it needs the Python package "
                    f"{error.name or 'of its database driver'}, which is not installed"
                ) from None
        self.artifact_root = artifact_root or _default_artifact_root(self.tracking_uri)
        self._experiment_ids: dict[str, str] = {}
        if self.tracking_uri.startswith(("http://", "https://")):
            _check_server(self.tracking_uri)

    @contextmanager
    def _errors(self, action: str) -> Iterator[None]:
        try:
            yield
        except MlflowException as error:
            message = f"{action} at {self.tracking_uri}: {cut(error.message, MESSAGE_LIMIT)}"
            raise registry_error(message, error) from None
        except (requests.exceptions.RequestException, ConnectionError, TimeoutError) as error:
            message = f"{action} at {self.tracking_uri}: {type(error).__name__}: {error}"
            raise registry_error(message, error) from None

    @staticmethod
    def _settled(call: Any) -> Any:
        """``call()``, retried briefly while MLflow's auth app refuses it (403): the creator's
        permission on a new experiment is written after the create request returns, so a
        worker of the same user opening it at that moment is refused for a moment."""
        for pause in PERMISSION_SETTLE_S:
            try:
                return call()
            except MlflowException as error:
                if error.get_http_status_code() != 403:
                    raise
                time.sleep(pause)
        return call()

    def _experiment(self, name: str, prefix: str) -> str:
        """The id of experiment ``name``, created on first use with its artifacts apart from
        every other experiment's (candidates and releases apart, so that permissions can
        differ: docs/design.md#rs-secrecy): under ``<artifact root>/<prefix>``, or on a server
        under the experiment's id (``mlflow-artifacts:/<id>``), the path by which MLflow's auth
        app judges a proxied artifact request (a path not led by an experiment id gets the
        server's default permission, none, even for the experiment's owner). The configured
        readers (:mod:`~dpmerge.registry.readers`) get READ on an experiment this creates."""
        if name not in self._experiment_ids:
            location = None
            if self.artifact_root and self.artifact_root != SERVER_ARTIFACT_ROOT:
                location = f"{self.artifact_root.rstrip('/')}/{prefix}"
            with self._errors(f"opening experiment {name!r}"):
                found = self._settled(lambda: self._client.get_experiment_by_name(name))
                if found is None:
                    try:
                        created = self._client.create_experiment(name, artifact_location=location)
                    except MlflowException as error:
                        if error.error_code != "RESOURCE_ALREADY_EXISTS":
                            raise
                        found = self._settled(lambda: self._client.get_experiment_by_name(name))
                    else:
                        readers = configured_readers().get(name, ())
                        grant_read(self.tracking_uri, EXPERIMENT, created, readers)
                        self._experiment_ids[name] = created
                if found is not None:
                    self._experiment_ids[name] = found.experiment_id
        return self._experiment_ids[name]

    def _ensure_registered_model(self, name: str, role: str) -> None:
        """Create registered model ``name`` unless it exists; the readers of its versions'
        experiment get READ on one this creates."""
        with self._errors(f"creating registered model {name}"):
            try:
                self._client.create_registered_model(
                    name,
                    tags={"dp.kind": "candidates" if role == ROLE_CANDIDATE else "releases"},
                    description=(
                        "dpmerge candidates (internal)"
                        if role == ROLE_CANDIDATE
                        else "dpmerge merged releases; see each version's privacy card"
                    ),
                )
            except MlflowException as error:
                if error.error_code != "RESOURCE_ALREADY_EXISTS":
                    raise
                return
            experiment = CANDIDATES_EXPERIMENT if role == ROLE_CANDIDATE else RELEASES_EXPERIMENT
            readers = configured_readers().get(experiment, ())
            grant_read(self.tracking_uri, REGISTERED_MODEL, name, readers)

    def _version(self, name: str, version: str) -> ModelVersion:
        try:
            return self._client.get_model_version(name, version)
        except MlflowException as error:
            if error.error_code == "RESOURCE_DOES_NOT_EXIST":
                raise RegistryError(f"{name} v{version} does not exist") from None
            raise registry_error(f"reading {name} v{version}: {error.message}", error) from None

    def _download_uri(self, name: str, version: str) -> str:
        """Where version ``version``'s files are downloaded from: what a ``models:/`` URI, and
        so MLflow's serving, reads (its source, or what a ``models:/`` source resolved to)."""
        with self._errors(f"reading where {name} v{version} is stored"):
            return self._client.get_model_version_download_uri(name, version)

    def _logged_model_location(self, model_id: str) -> str:
        """Where the files of logged model ``model_id`` are stored."""
        with self._errors(f"reading logged model {model_id}"):
            return self._client.get_logged_model(model_id).artifact_location

    def _model_tags(self, name: str) -> dict[str, str] | None:
        """The registered model's tags; ``None`` when there is no such model this user can see
        (MLflow's auth app answers PERMISSION_DENIED for a name the user has no grant on,
        existing or not: docs/stack.md#roles-and-permissions)."""
        try:
            return dict(self._client.get_registered_model(name).tags)
        except MlflowException as error:
            if error.error_code in ("RESOURCE_DOES_NOT_EXIST", "PERMISSION_DENIED"):
                return None
            message = f"reading registered model {name}: {error.message}"
            raise registry_error(message, error) from None

    def _aliases(self, name: str) -> dict[str, str]:
        with self._errors(f"reading aliases of {name}"):
            return {k: str(v) for k, v in self._client.get_registered_model(name).aliases.items()}

    def _search(self, filter_string: str) -> list[StoredVersion]:
        found: list[StoredVersion] = []
        token = None
        with self._errors(f"searching versions ({filter_string})"):
            while True:
                page = self._client.search_model_versions(filter_string, page_token=token)
                found.extend(StoredVersion.of(mv) for mv in page)
                token = page.token
                if not token:
                    return found

    def _wait_ready(self, name: str, version: str, timeout_s: float) -> ModelVersion:
        deadline = time.monotonic() + timeout_s
        while True:
            mv = self._version(name, version)
            if mv.status == "READY":
                return mv
            if mv.status == "FAILED_REGISTRATION":
                raise RegistryError(f"{name} v{version} failed registration: {mv.status_message}")
            if time.monotonic() > deadline:
                raise RegistryError(f"{name} v{version} not READY after {timeout_s:.0f} s")
            time.sleep(0.5)

    def _remember_run(self, info: MlflowRunInfo) -> None:
        _ARTIFACT_URIS[(self.tracking_uri, info.run_id)] = info.artifact_uri

    def _artifact_uri(self, run_id: str) -> str:
        """Where a run's artifacts live (it never changes: read once per process)."""
        key = (self.tracking_uri, run_id)
        if key not in _ARTIFACT_URIS:
            with self._errors(f"reading run {run_id}"):
                _ARTIFACT_URIS[key] = self._client.get_run(run_id).info.artifact_uri
        return _ARTIFACT_URIS[key]

    def _run_json(self, run_id: str, path: str) -> dict[str, Any]:
        """A run's JSON file, in one request once its artifact location is known (MLflow's
        ``download_artifacts(run_id, …)`` reads the run and lists the path first)."""
        with (
            self._errors(f"reading {path} of run {run_id}"),
            tempfile.TemporaryDirectory(prefix="dpmerge-read-") as scratch,
        ):
            repository = get_artifact_repository(self._artifact_uri(run_id), self.tracking_uri)
            local = Path(scratch) / Path(path).name
            repository._download_file(path, str(local))  # one file: MLflow's own per-file step
            return json.loads(local.read_text())

    def _mark_failed(self, name: str, version: str, reason: str | None = None) -> None:
        # best effort: without dp.status=ready the version is never promoted anyway
        with suppress(MlflowException, requests.exceptions.RequestException):
            self._client.set_model_version_tag(name, version, "dp.status", STATUS_FAILED)
            if reason:
                self._client.set_model_version_tag(name, version, FAILURE_TAG, reason)

    def _end_run(self, run_id: str, status: str, end_ms: int | None = None) -> None:
        with suppress(MlflowException, requests.exceptions.RequestException):
            self._client.set_terminated(run_id, status, end_time=end_ms)

    def _run_params(self, run_id: str) -> dict[str, str]:
        with self._errors(f"reading run {run_id}"):
            return dict(self._client.get_run(run_id).data.params)

    def _new_logged_model(self, experiment_id: str, run_id: str, role: str) -> LoggedModel:
        """A logged model of the run, to be filled by :meth:`_log_model`."""
        with self._errors("creating the logged model"):
            return self._client.create_logged_model(
                experiment_id, name=MODEL_ARTIFACT, source_run_id=run_id, tags={"dp.role": role}
            )

    def _log_model(
        self,
        logged: LoggedModel,
        run_id: str,
        module: nn.Module,
        loaded: ModelDir,
        record_bytes: bytes,
        card: PrivacyCard | None,
        dataset: str,
        key: WorkflowKey,
    ) -> tuple[str, list[str], dict[str, str]]:
        """Save ``module`` as a pt2 model with the dpmerge files as extra files, sign the
        directory in OpenSSF's model-signing format under ``key``
        (:mod:`dpmerge.model_signature`: ``model.sig``) and upload it as the run's logged model
        ``logged``. Returns its artifact location, the dpmerge files and the SHA-256 of every
        file uploaded, ``model.sig`` included (what a release's manifest signs).

        The input example (pt2 export traces with it and stores it) is random, drawn
        independently of everything: an RS release's weights are one candidate's, and a
        deterministic export would make their pt2 files, and so their S3 ETags, identical
        (docs/design.md#rs-secrecy). The model's signature states its input (a float32 tensor
        (n, *input shape)) and output (logits), its metadata how raw images of ``dataset`` (a
        published identifier) become that input, so a consumer can serve it as it is."""
        import mlflow.pytorch  # torch loads here: verifying a release needs neither
        import torch

        from dpmerge.data.datasets import DATASET_NAMES, preprocessing

        rng = np.random.default_rng(secrets.randbits(64))
        signature = ModelSignature(
            inputs=Schema([TensorSpec(np.dtype(np.float32), (-1, *loaded.spec.input_shape))]),
            outputs=Schema([TensorSpec(np.dtype(np.float32), (-1, loaded.spec.num_classes))]),
        )
        name = dataset_name(dataset)
        shape = ", ".join(str(d) for d in loaded.spec.input_shape)
        metadata = {  # a dataset without a loader (a test's) has only its shape to say
            "input": preprocessing(name) if name in DATASET_NAMES else f"float32 (n, {shape})",
            "output": f"float32 logits (n, {loaded.spec.num_classes}): the predicted class is "
            "the argmax",
        }
        example = rng.random((INPUT_EXAMPLE_BATCH, *loaded.spec.input_shape), dtype=np.float32)
        try:
            with tempfile.TemporaryDirectory(prefix="dpmerge-register-") as staging:
                files = _stage_files(Path(staging) / "files", loaded, record_bytes, card)
                model_path = Path(staging) / MODEL_ARTIFACT
                with _PT2_EXPORT_LOCK:
                    mlflow.pytorch.save_model(
                        module,
                        str(model_path),
                        mlflow_model=Model(
                            artifact_path=MODEL_ARTIFACT, run_id=run_id, model_id=logged.model_id
                        ),
                        input_example=example,
                        signature=signature,
                        metadata=metadata,
                        pip_requirements=[f"torch=={torch.__version__.split('+')[0]}"],
                        extra_files=[str(f) for f in files],
                        serialization_format="pt2",
                    )
                sign_directory(model_path, key)
                digests = file_digests(model_path)
                self._upload(logged.model_id, model_path)
        except BaseException:
            with suppress(MlflowException):
                self._client.finalize_logged_model(logged.model_id, LoggedModelStatus.FAILED)
            raise
        with self._errors("finalising the logged model"):
            self._client.finalize_logged_model(logged.model_id, LoggedModelStatus.READY)
        return logged.artifact_location, [f.name for f in files], digests

    def _upload(self, model_id: str, model_path: Path) -> None:
        """Upload a logged model's files, :data:`UPLOAD_THREADS` at once (MLflow's own upload
        sends them one after another: a dozen round trips of each registration)."""
        files = [f for f in sorted(model_path.rglob("*")) if f.is_file()]

        def upload(path: Path) -> None:
            folder = path.parent.relative_to(model_path).as_posix()
            self._client.log_model_artifact(model_id, str(path), None if folder == "." else folder)

        with (
            self._errors("uploading the logged model"),
            ThreadPoolExecutor(UPLOAD_THREADS) as threads,
        ):
            list(threads.map(upload, files))

    def _verify(
        self,
        name: str,
        version: str,
        *,
        model_id: str,
        files: Sequence[str],
        card: PrivacyCard | None,
    ) -> None:
        """The version's model, dpmerge files and card are all stored and consistent (read
        concurrently: each read is a round trip to MLflow)."""
        mv = self._version(name, version)
        with (
            self._errors(f"verifying {name} v{version}"),
            ThreadPoolExecutor(3) as threads,
        ):
            extra = threads.submit(self._client.list_logged_model_artifacts, model_id, EXTRA_DIR)
            top_level = threads.submit(self._client.list_logged_model_artifacts, model_id)
            card_read = (
                threads.submit(self._run_json, mv.run_id, CARD_JSON) if card is not None else None
            )
            stored = {Path(f.path).name for f in extra.result()}
            top = {f.path for f in top_level.result()}
        missing = sorted(set(files) - stored) + (["MLmodel"] if "MLmodel" not in top else [])
        if missing:
            raise RegistryError(f"{name} v{version}: artifacts missing after upload: {missing}")
        if card_read is not None:
            stored_card = card_read.result()
            epsilon = tag_float(mv.tags.get("dp.epsilon"))
            if stored_card.get("guarantee", {}).get("epsilon") != epsilon:
                raise RegistryError(f"{name} v{version}: the stored card disagrees with dp.epsilon")


def _stage_files(
    staging: Path, loaded: ModelDir, record_bytes: bytes, card: PrivacyCard | None
) -> list[Path]:
    """Copy a model directory's files to ``staging``, with ``record_bytes`` as its record. A
    merge's ``privacy.json`` (the full report: it names the candidates) is not published; its
    public card is."""
    staging.mkdir(parents=True, exist_ok=True)
    files = []
    for name in (WEIGHTS_FILE, MODEL_FILE, METRICS_FILE):
        source = loaded.path / name
        if source.is_file():
            (staging / name).write_bytes(source.read_bytes())
            files.append(staging / name)
    (staging / RECORD_FILE).write_bytes(record_bytes)
    files.append(staging / RECORD_FILE)
    if card is not None:
        (staging / CARD_MARKDOWN).write_text(card.markdown)
        (staging / CARD_JSON).write_text(card.to_json())
        files += [staging / CARD_MARKDOWN, staging / CARD_JSON]
    return files


def _default_artifact_root(tracking_uri: str) -> str | None:
    if tracking_uri.startswith(("http://", "https://")):
        return SERVER_ARTIFACT_ROOT
    if not tracking_uri.startswith("sqlite:///"):
        return None
    database = Path(tracking_uri.removeprefix("sqlite:///")).resolve()
    return (database.parent / "mlartifacts").as_uri()


def _check_server(url: str) -> None:
    health = probe(f"{url.rstrip('/')}/health", timeout_s=5)
    if not health.ok:
        raise RegistryUnavailableError(
            f"MLflow server {url} unreachable ({health.error}); start it "
            f"(`{command('stack', 'up')}`) "
            "or point MLFLOW_TRACKING_URI elsewhere"
        )
