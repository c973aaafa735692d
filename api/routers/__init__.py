"""One router per concern; handlers stay thin (validate, call the data layer, wake long-polls)."""
