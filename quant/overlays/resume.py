"""The partial overlay that an interrupted resumable build keeps, and its journal.

A builder with ``resumable = True`` (``ple build --format``: six hours for the real table on two
cores) builds ``OUT`` in ``.OUT.partial``, a directory made exclusively and carrying flashnext's
marker, and keeps ``.OUT.partial.json`` beside it (:class:`OverlayJournal`): what the build reads
and how, the partial's device and inode, every piece written into its shards with the piece's
sha256, and the builder's own progress. The journal is rewritten (a temporary file and a rename)
each time the builder calls ``checkpoint``, only once the shards hold durably what it says. It is
written before the partial is made, so that a partial always has one, and removed once the partial
is renamed into place.

The next run of the same command finds them under the output's lock and continues only the build of
the same input, into the very directory that build made, from what it can check: the journal's
``source`` must equal this run's; the partial must be the directory of the journal's device and
inode, with the marker; every piece the journal records must have its digest in the shard's bytes
(read again: a bit flipped or a block zeroed since is found); and the builder's ``restore`` takes
nothing else on trust either (it recomputes or checks every value the result depends on, and a
chunk it says is done must be among the pieces checked). Otherwise it starts over and says why in
one line. What it removes then is only a link or a directory flashnext made; anything else at the
partial's name is refused, left as it is. What is still trusted: that a piece whose digest checks
out holds what the builder computed there. The journal is the build's own record, not a signature:
a hand that rewrites a piece and its digest alike is not caught (what follows from that for its
output, each builder's ``restore`` says).

A :class:`FlashnextError` once the build is under way is a refusal (the input changed, or what was
made would be refused when read back): the partial and the journal go, as a resume would only be
refused again. On anything else (Ctrl-C, a kill, a full disk, a crash) they stay for the next run.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path
from typing import Annotated, Any, Callable, Literal

from pydantic import Field

from flashnext.errors import FlashnextError, named
from flashnext.quant.checkpoint.fsutil import (OUTPUT_MARKER, HeldDirectory, OutputDirectory, confined, output_file,
                                               interrupts_held, remove_leftovers, write_text_at)
from flashnext.quant.formats.safetensors_io import ShardWriter, TensorSpec, WrittenBytes
from flashnext.quant.records.jsonfile import parse_json, validate
from flashnext.quant.records.strict import Count, PartialIdentity, Sha256, StrictRecord

JOURNAL_FORMAT = "flashnext.overlay-journal/2"


def starting_over(partial: Path, why: str) -> str:
    """The one line a resumable writer says when it will not continue the interrupted build."""
    return f"starting over: the interrupted build in {partial} cannot be resumed: {why}"


def notice_on_stderr(line: str) -> None:
    """Where a resumable writer says it resumes or starts over, unless its caller takes the line."""
    print(line, file=sys.stderr, flush=True)


class WrittenPiece(StrictRecord):
    """One piece written into a shard (:class:`WrittenBytes`), as the journal holds it."""

    tensor: str
    offset: Count
    length: Annotated[int, Field(gt=0)]  # an empty write is no piece
    sha256: Sha256


class OverlayJournal(StrictRecord):
    """``.OUT.partial.json``: the journal of an interrupted resumable overlay build."""

    format: Literal["flashnext.overlay-journal/2"]
    made_by: str  # the command
    source: dict[str, Any]  # what a resume must find unchanged, each under the name a message gives it
    partial: PartialIdentity | None  # None until the partial directory is made
    written: dict[str, list[WrittenPiece]]  # per shard file, every piece in it as written, with its digest
    state: dict[str, Any]  # the builder's own progress (its ``resume_state``), checked by its ``restore``

    @classmethod
    def not_this_record(cls, data: Any) -> str | None:
        if not isinstance(data, dict) or data.get("format") != JOURNAL_FORMAT:
            return f"not a {JOURNAL_FORMAT} journal"
        return None


class ResumableOutput:
    """One resumable build's partial overlay and its journal, beside the output held by ``output``."""

    def __init__(self, output: OutputDirectory, made_by: str, source: dict, notice: Callable[[str], None]):
        self.output = output
        self.made_by = made_by
        self.source = json.loads(json.dumps(source))  # as the journal will hold it: lists, not tuples
        self.notice = notice
        self.partial_name = f".{output.path.name}.partial"
        self.journal_name = f".{output.path.name}.partial.json"
        self.partial: HeldDirectory | None = None
        self.writers: dict[str, ShardWriter] = {}

    def __enter__(self) -> "ResumableOutput":
        return self

    def __exit__(self, *exc) -> None:
        self._close()

    @property
    def path(self) -> Path:
        """The partial directory, resolved through its descriptor (for this process's opens)."""
        return self.partial.through()

    def _shown(self, name: str) -> Path:
        return self.output.path.parent / name

    # --- finding the interrupted build ------------------------------------------------------------

    def resume(self, plans: dict[str, list[TensorSpec]], metadata: dict[str, dict],
               restore: Callable[[dict, dict[str, ShardWriter]], None]) -> bool:
        """Continue the interrupted build, if there is one to continue: its partial held again, its
        shards reopened with every recorded piece checked, and the builder's progress handed to
        ``restore`` with those shards (it raises FlashnextError or ValueError on a state that does
        not check out). False: there is none, and what an interrupted build left was removed, after
        one line saying why."""
        parent = self.output.parent
        remove_leftovers(self._shown(self.journal_name), parent)  # a killed journal write's temporary
        if parent.lstat(self.journal_name) is None:
            if parent.lstat(self.partial_name) is None:
                return False
            raise FlashnextError(f"{self._shown(self.partial_name)} exists but is no interrupted flashnext build "
                                 f"(no {self.journal_name}); remove it or choose another {named('out')}")
        why = self._why_not(plans, metadata, restore)
        if why is None:
            self.notice(f"resuming the interrupted build in {self._shown(self.partial_name)}")
            return True
        self._close()
        if not self.output.remove_partial(self.partial_name):
            raise FlashnextError(f"{self._shown(self.partial_name)} cannot be resumed ({why}) and is not a "
                                 f"partial overlay flashnext made: remove it yourself or choose another {named('out')}")
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.journal_name, dir_fd=parent.fd)
        self.notice(starting_over(self._shown(self.partial_name), why))
        return False

    def _why_not(self, plans, metadata, restore) -> str | None:
        """Why the interrupted build cannot be continued; None: it is open again, ready to go on."""
        shown = self._shown(self.journal_name)
        try:
            journal = validate(parse_json(self.output.parent.read_regular(self.journal_name), str(shown)),
                               OverlayJournal, str(shown))
        except (FlashnextError, OSError) as e:
            return f"its journal is unreadable ({getattr(e, 'strerror', None) or e})"
        if journal.made_by != self.made_by:
            return f"it is {journal.made_by}'s"
        differ = sorted(k for k in self.source.keys() | journal.source.keys()
                        if self.source.get(k) != journal.source.get(k))
        if differ:
            return f"it was built from another {', '.join(differ)}"
        if journal.partial is None:
            return "it was interrupted before it had made its partial"
        self.partial = self.output.open_partial(self.partial_name, (journal.partial.dev, journal.partial.inode))
        if self.partial is None:
            return (f"{self.partial_name} is not the directory that build made (gone, a link, or replaced "
                    "since)")
        strange = sorted(set(journal.written) - set(plans))
        if strange:
            return f"its journal records writes into {strange[0]}, which this build does not write"
        try:
            for filename, specs in plans.items():
                path = confined(self.path, filename, str(shown))
                resumed = [WrittenBytes(**piece.model_dump()) for piece in journal.written.get(filename, [])]
                self.writers[filename] = ShardWriter(path, specs, metadata[filename], resumed=resumed,
                                                     shown=self._shown(self.partial_name) / filename)
            restore(journal.state, self.writers)
        except (FlashnextError, ValueError) as e:
            self._close()
            return f"{e}"
        # Whatever the interrupted run wrote after its shards (the index, config.json, overlay.json,
        # a temporary of one) is made again at the end.
        keep = {OUTPUT_MARKER} | {filename.split("/")[0] for filename in plans}
        for name in os.listdir(self.partial.fd):
            if name not in keep:
                self.partial.remove_tree(name)
        return None

    # --- a new partial ----------------------------------------------------------------------------

    def start(self, plans: dict[str, list[TensorSpec]], metadata: dict[str, dict], state: dict) -> None:
        """A new partial overlay with empty shards of ``plans``, and its journal at ``state``."""
        self._write_journal(state)  # first: a partial always has its journal
        with interrupts_held():  # held as made, so an interrupt finds it in self.partial
            self.partial = self.output.make_partial(self.partial_name, self.made_by)
        for filename, specs in plans.items():
            self.writers[filename] = ShardWriter(output_file(self.path, filename), specs, metadata[filename],
                                                 digests=True, shown=self._shown(self.partial_name) / filename)
        os.fsync(self.partial.fd)
        os.fsync(self.output.parent.fd)
        self._write_journal(state)  # now with the partial's device and inode

    def allocated(self) -> int:
        """Bytes the partial's shards already hold on disk (a resume needs that much less)."""
        return sum(os.stat(w.path, follow_symlinks=False).st_blocks * 512 for w in self.writers.values())

    # --- while it runs ----------------------------------------------------------------------------

    def save(self, state: dict) -> None:
        """Record ``state`` once what the shards hold is durable: a kill after this loses nothing
        before it."""
        for writer in self.writers.values():
            writer.sync()
        self._write_journal(state)

    def _write_journal(self, state: dict) -> None:
        partial = None
        if self.partial is not None:
            dev, inode = self.partial.identity()
            partial = PartialIdentity(dev=dev, inode=inode)
        journal = OverlayJournal(format=JOURNAL_FORMAT, made_by=self.made_by, source=self.source, partial=partial,
                                 written={f: [vars(piece) for piece in w.written] for f, w in self.writers.items()},
                                 state=state)
        # json.dumps writes each float as repr, which reads back to the very same float: restored
        # sums go on exactly as an uninterrupted build's.
        write_text_at(self.output.parent, self.journal_name, json.dumps(journal.model_dump(mode="json")))

    # --- the end ----------------------------------------------------------------------------------

    def commit(self) -> None:
        """Rename the complete partial to the output, then drop the journal: also when what fails is
        making the rename durable after it (a full disk at the fsync), as the journal then records a
        partial that is gone, and would be left beside the finished output."""
        try:
            self.output.commit(self.partial_name, self.partial)
        except BaseException:
            if self.output.parent.lstat(self.partial_name) is None:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.journal_name, dir_fd=self.output.parent.fd)
            raise
        self._drop_journal()

    def discard(self) -> None:
        """Remove the partial and its journal (a refusal: a resume would be refused again)."""
        if self.partial is not None:
            self.output.discard(self.partial_name, self.partial)
        self._drop_journal()

    def _drop_journal(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.journal_name, dir_fd=self.output.parent.fd)
        os.fsync(self.output.parent.fd)

    def _close(self) -> None:
        for writer in self.writers.values():
            writer.abort()
        self.writers = {}
        if self.partial is not None:
            self.partial.close()
            self.partial = None
