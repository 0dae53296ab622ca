"""Web views split by concern: backlog arithmetic, failed-topic summary, dashboard HTML, admin actions."""
