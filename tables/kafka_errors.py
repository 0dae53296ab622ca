"""Recognising Kafka errors through the shapes Faust gives them."""

from __future__ import annotations

from aiokafka.errors import MessageSizeTooLargeError, RecordListTooLargeError
from aiokafka.errors import RecordTooLargeError as KafkaRecordTooLargeError

_TOO_LARGE = (MessageSizeTooLargeError, RecordListTooLargeError, KafkaRecordTooLargeError)


def is_too_large(error: BaseException) -> bool:
    """True for a send refused for its size, by the producer or by the broker.

    Faust's aiokafka driver wraps every ``KafkaError`` raised by ``send`` in ``faust.exceptions.ProducerSendError``
    (the original is its ``__cause__``), while a refusal in the broker's answer fails the returned future with
    aiokafka's own class: both shapes are recognised.
    """
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        if isinstance(current, _TOO_LARGE):
            return True
        seen.add(id(current))
        current = current.__cause__
    return False
