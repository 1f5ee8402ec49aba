"""Imported only in the fork server that run_world forks its ranks from (common.launch preloads
it first): the server ignores SIGTERM.

A signal meant for the whole job, `kill -TERM -<process group>` or a scheduler's stop to every
process of a job, reached the server too, and it died. Its launcher learns each rank's exit code
through it, so a dead server reads as every rank gone with 255: the launcher ended a world whose
ranks were saving a checkpoint on that very SIGTERM, with a traceback. Ignored here, the server
leaves only when its launcher does (multiprocessing's own rule), and each rank sets SIGTERM back
to its default as it starts (common.launch._rank_main). SIGINT needs nothing: multiprocessing's
server ignores it already, and gives its children the handler it had.
"""

import signal

signal.signal(signal.SIGTERM, signal.SIG_IGN)
