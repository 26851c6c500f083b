ALTER TABLE customers ADD COLUMN tier TEXT NOT NULL DEFAULT 'standard';
CREATE INDEX idx_customers_tier ON customers(tier);
