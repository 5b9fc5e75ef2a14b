// The types check.py checks a dashboard JSON against: @grafana/schema's Dashboard, and for each
// panel its plugin's own options and custom field config (Dashboard leaves both open:
// Record<string, unknown>).
import type { Dashboard } from '@grafana/schema';
import type { Options as GaugeOptions } from '@grafana/schema/dist/esm/raw/composable/gauge/panelcfg/x/GaugePanelCfg_types.gen';
import type { Options as StatOptions } from '@grafana/schema/dist/esm/raw/composable/stat/panelcfg/x/StatPanelCfg_types.gen';
import type {
    FieldConfig as TableFieldConfig,
    Options as TableOptions,
} from '@grafana/schema/dist/esm/raw/composable/table/panelcfg/x/TablePanelCfg_types.gen';
import type {
    FieldConfig as TimeSeriesFieldConfig,
    Options as TimeSeriesOptions,
} from '@grafana/schema/dist/esm/raw/composable/timeseries/panelcfg/x/TimeSeriesPanelCfg_types.gen';

// A JSON file holds an enum member as its value ("absolute"), which TypeScript does not accept
// where a string enum (ThresholdsMode.Absolute) is expected: Json<T> is T with each string enum
// replaced by the union of its values. Numeric enums (graphTooltip: 1) are already numbers.
export type Json<T> = T extends string ? `${T}`
    : T extends number | boolean | null | undefined ? T
    : T extends ReadonlyArray<infer U> ? Array<Json<U>>
    : T extends object ? { [K in keyof T]: Json<T[K]> }
    : T;

// Every field optional, at every depth: Grafana fills in a plugin's defaults for options a
// dashboard leaves out, so only the names and types of those present are checked.
export type PartialJson<T> = T extends string ? `${T}`
    : T extends number | boolean | null | undefined ? T
    : T extends ReadonlyArray<infer U> ? Array<PartialJson<U>>
    : T extends object ? { [K in keyof T]?: PartialJson<T[K]> }
    : T;

export type DashboardJson = Json<Dashboard>;

// The panel types a dashboard may use; check.py refuses others until they are added here.
type NoCustom = Record<string, never>;   // a plugin without custom field config takes none
export interface Plugins {
    gauge: { options: GaugeOptions; custom: NoCustom };
    stat: { options: StatOptions; custom: NoCustom };
    table: { options: TableOptions; custom: TableFieldConfig };
    timeseries: { options: TimeSeriesOptions; custom: TimeSeriesFieldConfig };
}
export type OptionsJson<P extends keyof Plugins> = PartialJson<Plugins[P]['options']>;
export type CustomJson<P extends keyof Plugins> = PartialJson<Plugins[P]['custom']>;
