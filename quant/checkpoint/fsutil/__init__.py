"""Where flashnext may write, and how: path confinement, output guards, locks and atomic outputs.

Every writer goes through this package, so that the rules hold for every command:

* a path read from a file (an index's shard name, a manifest's file path) is untrusted and must stay
  inside its root (:func:`confined`, :mod:`.confinement`);
* an output never is, contains or lies inside an input (:func:`refuse_overlap` on the paths before
  any work, :func:`refuse_overlap_open` on the directories actually opened), nor lies inside the
  part of a Hugging Face hub cache that huggingface_hub alone writes (:func:`refuse_hub_cache`;
  :mod:`.overlap`);
* ``--force`` replaces only what flashnext made, and only the same command's: a directory holding
  :data:`OUTPUT_MARKER` whose ``made_by`` is that command (:func:`require_flashnext_output`,
  :mod:`.markers`);
* one writer per output at a time (:func:`output_lock`, :mod:`.locks`), and the output appears whole
  or not at all (:func:`atomic_directory` in :mod:`.directories`, :func:`write_text_atomic` in
  :mod:`.files`); what a killed writer left behind is removed by the next one, by its exact
  temporary name (:func:`remove_leftovers`, :mod:`.leftovers`), and an interrupt never lands
  between making a temporary and the ``try`` that removes it (:func:`interrupts_held`,
  :mod:`.interrupts`);
* what a command needs only while it runs lives in a scratch directory of the system's temporary
  folder that it removes when it ends (:func:`scratch_directory`, :mod:`.scratch`), and that the next
  run removes if it was killed first: by the marker naming the process that made it, once that
  process is gone;
* every create, rename and unlink goes through the output's parent held open (:class:`HeldDirectory`,
  :mod:`.held`), never through a link; content hashes are :mod:`.hashing`'s, free space
  :mod:`.space`'s.

The names below are re-exported because callers name the rules, not the module that holds each
one (``fsutil.atomic_directory``). A test that replaces a function patches the module that calls it.
"""

from flashnext.quant.checkpoint.fsutil.confinement import confined, output_file, write_json
from flashnext.quant.checkpoint.fsutil.directories import (OutputDirectory, atomic_directory, output_directory,
                                                           refuse_existing_output)
from flashnext.quant.checkpoint.fsutil.files import (OutputFile, atomic_file, check_file_destination, write_new_file,
                                                     write_text_at, write_text_atomic)
from flashnext.quant.checkpoint.fsutil.hashing import HASH_CHUNK, sha256_bytes, sha256_file
from flashnext.quant.checkpoint.fsutil.held import (HeldDirectory, display_path, fsync_dir, make_parents,
                                                    remove_empty, write_new)
from flashnext.quant.checkpoint.fsutil.interrupts import interrupts_held
from flashnext.quant.checkpoint.fsutil.leftovers import remove_leftovers
from flashnext.quant.checkpoint.fsutil.locks import output_lock, remove_stale_lock
from flashnext.quant.checkpoint.fsutil.markers import (MARKER_LIMIT, OUTPUT_MARKER, read_output_marker,
                                                       require_flashnext_output, write_marker)
from flashnext.quant.checkpoint.fsutil.overlap import (HUB_OWN_FOLDERS, HUB_REPO_FOLDER, hub_caches, refuse_hub_cache,
                                                       refuse_overlap, refuse_overlap_open)
from flashnext.quant.checkpoint.fsutil.scratch import SCRATCH_KINDS, remove_abandoned_scratch, scratch_directory
from flashnext.quant.checkpoint.fsutil.space import check_free_space, existing_ancestor

__all__ = [
    "HASH_CHUNK", "HUB_OWN_FOLDERS", "HUB_REPO_FOLDER", "MARKER_LIMIT", "OUTPUT_MARKER", "SCRATCH_KINDS",
    "HeldDirectory", "OutputDirectory", "OutputFile", "atomic_directory", "atomic_file", "check_file_destination",
    "check_free_space", "confined", "display_path", "existing_ancestor", "fsync_dir", "hub_caches",
    "interrupts_held", "make_parents", "output_directory", "output_file", "output_lock", "read_output_marker",
    "refuse_existing_output", "refuse_hub_cache", "refuse_overlap", "refuse_overlap_open",
    "remove_abandoned_scratch", "remove_empty", "remove_leftovers", "remove_stale_lock", "require_flashnext_output",
    "scratch_directory", "sha256_bytes", "sha256_file", "write_json", "write_marker", "write_new", "write_new_file",
    "write_text_at", "write_text_atomic"
]
