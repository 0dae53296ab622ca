"""Rebound's Spark data pipeline: a Python Kafka data source and the facts/report/tune/inventory/redrive jobs."""
