"""``tokcap report``'s parts: reading records, counting them, drawing the figures."""
