"""The seeds' demo: an items service whose updates can arrive before their creates (DESIGN.md section 3)."""
