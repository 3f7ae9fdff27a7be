"""The imperative shell over the database: tables, transactions, reads, projections."""
