"""Rebound's Spark data pipeline: a Python Kafka data source and the facts/report/tune/inventory/redrive jobs."""

from pipeline._requirements import check_pyspark

check_pyspark()
