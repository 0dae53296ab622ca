"""The fault-injection conservation harness behind ``make chaos``.

Several real ``faust -A app worker`` processes on the embedded broker handle a seeded plan of keyed messages whose
values script the handler's behaviour, while workers are killed, stopped, added and removed and the broker itself is
paused. An independent call log (SQLite, written by :mod:`chaos.handler`) and the product's own output topics are then
checked for lost messages, messages in more than one terminal state, duplicate calls and retries run before they were
due. The checker (:mod:`chaos.checker`) is pure, so its failure modes are unit-tested on hand-made inputs.
"""
